#!/usr/bin/env python3
"""Trains torchtitan's DeepSeek-V3 debug model on one GPU with torchtitan's own MoE experts and with its MoE blocks
swapped onto mok (mok.integrations.torchtitan.swap_moe_experts), from the same initial parameters on the same data,
and checks that the two learn alike and that ours is reproducible bit for bit.

    python3 examples/torchtitan_moe.py [--steps 300] [--compile] [--shared-experts 1] [--out DIR]

The model: torchtitan 0.3.0's model_registry("debugmodel") of torchtitan.models.deepseek_v3, unchanged: 6 layers
(1 dense, 5 MoE), dim 256, multi-head latent attention (16 heads, FlexAttention), vocabulary 2048, MoE blocks of
8 routed experts of width 256, top-3 softmax routing, auxiliary-loss-free load balancing, 2 shared experts (one
SwiGLU of width 512: mok runs the routed experts and torchtitan's FeedForward the shared one). --shared-experts 1
makes the shared expert as wide as a routed one (DeepSeek-V3 671B's layout): then mok runs it too, in the same
kernel. The data: train_moe.py's order-2 Markov chain over the first 64 token ids (the loss falls from about
ln 2048 = 7.6 towards the chain's entropy, 1.31 nats). Training as torchtitan trains on one GPU, without its
trainer: bf16 parameters with fp32 master weights in AdamW (train_moe.py's MixedPrecisionAdamW), the gradient norm
clipped to 1, torchtitan's own load-balancing hook (register_moe_load_balancing_hook: the expert bias update
before each optimizer step), 10 warm-up steps then cosine; --compile applies torchtitan's apply_compile
(torch.compile per transformer block). Runs, each from the same initial state:
  ours, twice    the MoE blocks swapped onto mok (the same parameters and state-dict keys);
  torchtitan     the model as torchtitan builds it;
  mm loop        torchtitan's model with its experts' products as one torch.mm per expert (eager also under
                 --compile): the same arithmetic rounded by another kernel, printed as the floor of the gap.
Checks (exit status 1 if one fails): ours' two runs give bitwise equal losses and final parameters (state dicts,
expert biases included); the first losses agree within 0.02; the 20-step moving averages of the losses of ours and
torchtitan stay within 0.02 nats of each other over the whole run; both learned (mean of the last 10 % of the
steps below 80 % of the first loss). Prints a loss table, the tokens/s of each run and their ratio, and writes
DIR/losses.csv and DIR/loss_curves.png. Time with the defaults on one H200 (measured): about two minutes eager
(the four runs of 300 steps), about three and a half with --compile.

Needs an NVIDIA Hopper GPU (it says so and stops otherwise; --help works anywhere) and torchtitan 0.3.0
(pip install torchtitan==0.3.0; without a registry its wheel and the pure-Python wheels its model code imports,
spmd_types, tyro, docstring_parser and typeguard, installed with pip install --no-deps). On torch 2.11, which
lacks a class torchtitan 0.3.0 imports for FSDP, mok.integrations.torchtitan.patch_torch_for_torchtitan() adds a
placeholder for it first (this example does not use FSDP).
"""
import argparse
import os
import sys
import time
import types

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before torch loads it)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mok  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_moe  # noqa: E402  (the data, the optimizer, the moving average and the loss-curve PNG)

FLAVOR = "debugmodel"
RUNS = (("ours run 1", "ours"), ("ours run 2", "ours"), ("torchtitan", "torchtitan"),
        ("torchtitan, mm loop", "torchtitan_mm_loop"))


def make_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=train_moe.positive_int, default=300,
                   help="optimizer steps of each run (the first 10 are not timed)")
    p.add_argument("--batch", type=train_moe.positive_int, default=16, help="sequences per step")
    p.add_argument("--seq", type=train_moe.positive_int, default=512,
                   help="tokens per sequence (batch * seq: mok's tokens per call)")
    p.add_argument("--lr", type=train_moe.positive_float, default=1e-4,
                   help="AdamW's peak learning rate (10 warm-up steps, then cosine down to a tenth). torchtitan's "
                   "debug configs use 8e-4; there this model's loss spikes at steps that rounding decides, so two "
                   "correct implementations drift apart by up to 0.44 nats (docs/perf_notes.md)")
    p.add_argument("--seed", type=int, default=1, help="seed of the data and of the initial parameters")
    p.add_argument("--shared-experts", type=int, default=2, choices=(1, 2),
                   help="shared experts of each MoE block (torchtitan's debugmodel has 2, one SwiGLU of twice the "
                   "routed width, which stays torchtitan's; 1: the routed width, which mok fuses into its kernel)")
    p.add_argument("--attention", default="flex", choices=("flex", "varlen"),
                   help="torchtitan's attention backend (attn_backend of model_registry)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block, as torchtitan's apply_compile does")
    p.add_argument("--out", default="torchtitan_moe_out", help="folder for losses.csv and loss_curves.png")
    return p


# ---------------------------------------------------------------------------------------------------------------
# The model, as torchtitan builds it


def import_torchtitan():
    """torchtitan's pieces this example uses (SystemExit saying what to install when torchtitan is missing)."""
    from mok.integrations import torchtitan as mok_titan
    mok_titan.patch_torch_for_torchtitan()
    try:
        from torchtitan.components.optimizer import register_moe_load_balancing_hook
        from torchtitan.config import CompileConfig
        from torchtitan.distributed.compile import apply_compile
        from torchtitan.models.deepseek_v3 import model_registry
    except ImportError as e:
        raise SystemExit(f"torchtitan_moe: needs torchtitan ({mok_titan.INSTALL_HINT}): {e}") from None
    return mok_titan, register_moe_load_balancing_hook, CompileConfig, apply_compile, model_registry


class OneDevice:
    """What torchtitan's load-balancing hook and apply_compile ask of its ParallelDims on one GPU: no mesh, no
    tensor or expert parallelism."""
    ep_enabled = False
    tp_enabled = False
    tp = 1

    def get_optional_mesh(self, name):
        return None


class StepPreHooks:
    """Stands in for torchtitan's OptimizersContainer where register_moe_load_balancing_hook registers its hook."""

    def __init__(self):
        self.hooks = []

    def register_step_pre_hook(self, hook):
        self.hooks.append(hook)

    def run(self):
        for hook in self.hooks:
            hook()


def model_config(args, model_registry):
    """torchtitan's DeepSeek-V3 debugmodel config; --shared-experts 1 narrows each shared expert to the routed width."""
    config = model_registry(FLAVOR, attn_backend=args.attention).model
    for layer in list(config.layers) + list(getattr(config, "mtp_layers", None) or []):
        moe = getattr(layer, "moe", None)
        if moe is None or moe.shared_experts is None:
            continue
        width = moe.routed_experts.inner_experts.hidden_dim * args.shared_experts
        shared = moe.shared_experts
        shared.w1.out_features = shared.w3.out_features = shared.w2.in_features = width
    return config


def build_model(config, device, state=None, seed=None):
    """The model on `device` with bf16 parameters (buffers as torchtitan makes them: fp32 expert biases and token
    counts, the RoPE cache): built on meta, moved with to_empty, initialized by torchtitan's init_states (seeded),
    then loaded with `state` when given."""
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=None)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    if state is not None:
        model.load_state_dict(state)
    return model


def mm_loop(self, *, A, B_t, offs):
    """GroupedExperts._grouped_mm (torchtitan's seam for other kernels) as one torch.mm per expert: the same
    products, rounded by another kernel. Rows past the last offset are zeros. Reads the offsets on the host."""
    pieces, start = [], 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            pieces.append(A[start:end] @ B_t[e])
        start = end
    pieces.append(A.new_zeros(A.shape[0] - start, B_t.shape[-1]))
    return torch.cat(pieces)


def use_mm_loop(model):
    """torchtitan's own experts computed by mm_loop: the floor of the gap between two implementations that round
    differently (what the comparison with ours can be held to)."""
    from torchtitan.models.common.moe import GroupedExperts
    swapped = 0
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module._grouped_mm = types.MethodType(mm_loop, module)
            swapped += 1
    if swapped == 0:
        raise SystemExit("torchtitan_moe: no GroupedExperts in the model for the mm-loop run")


# ---------------------------------------------------------------------------------------------------------------
# Training


def train(kind, args, titan, config, state, data, device):
    """Losses [steps] (fp32), tokens/s after the first 10 steps, the final state dict (a copy)."""
    mok_titan, register_moe_load_balancing_hook, CompileConfig, apply_compile, _ = titan
    model = build_model(config, device, state)
    tokens_per_call = args.batch * args.seq
    if kind == "ours":
        report = mok_titan.swap_moe_experts(model, max_tokens=tokens_per_call)
        print(report, flush=True)
        if report.refused or not report.swapped:
            raise SystemExit("torchtitan_moe: the swap left MoE blocks as they were (above)")
    elif kind == "torchtitan_mm_loop":
        use_mm_loop(model)
    if args.compile and kind != "torchtitan_mm_loop":  # mm_loop reads the offsets on the host: it stays eager
        apply_compile(model, compile_config=CompileConfig(enable=True, backend="inductor"), parallel_dims=OneDevice())
    model.train()
    params = list(model.parameters())
    optimizer = train_moe.MixedPrecisionAdamW(params, args.lr)
    load_balancing = StepPreHooks()
    register_moe_load_balancing_hook(load_balancing, [model], OneDevice())
    positions = torch.arange(args.seq, device=device).expand(args.batch, args.seq)
    masks = model.get_attention_masks(positions)  # one document per sequence: the same every step
    losses = torch.zeros(args.steps, device=device)
    timed_from = min(10, args.steps - 1)
    vocab = config.vocab_size
    for step in range(args.steps):
        if step == timed_from:
            torch.cuda.synchronize()
            start = time.perf_counter()
        batch = data[step]
        logits = model(batch[:, :-1], positions=positions, attention_masks=masks)
        loss = F.cross_entropy(logits.float().view(-1, vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_norm=1.0, foreach=True)
        load_balancing.run()  # torchtitan's expert-bias update, an optimizer step pre-hook there
        optimizer.step(train_moe.learning_rate(args, step))
        optimizer.zero_grad()
        losses[step] = loss.detach()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens_per_s = (args.steps - timed_from) * tokens_per_call / elapsed
    if kind == "ours":
        for module in mok_titan.swapped_modules(model):
            mok.check_status(module.workspace)
        mok_titan.close_moe_workspaces(model)
    final = {name: value.detach().clone() for name, value in model.state_dict().items()}
    return losses.cpu(), tokens_per_s, final


def expert_bias_range(state):
    """max |expert_bias_E| over the MoE blocks of a state dict: how far the load balancing moved the biases."""
    return max((v.abs().max().item() for k, v in state.items() if k.endswith("expert_bias_E")), default=0.0)


def report(args, runs):
    """Prints the table and the checks; writes the CSV and the PNG. Returns the failed checks."""
    ours1, ours2, ref, loop = (runs[name][0].tolist() for name, _ in RUNS)
    steps = len(ours1)
    print(f"\n{'step':>6} {'ours run 1':>12} {'ours run 2':>12} {'torchtitan':>12} {'titan mm loop':>14} "
          f"{'ours - titan':>13} {'loop - titan':>13}")
    for s in sorted(set(list(range(0, steps, max(1, steps // 15))) + [steps - 1])):
        print(f"{s:>6} {ours1[s]:>12.5f} {ours2[s]:>12.5f} {ref[s]:>12.5f} {loop[s]:>14.5f} {ours1[s] - ref[s]:>+13.5f} "
              f"{loop[s] - ref[s]:>+13.5f}")
    print(f"\n{'run':<20} {'tokens/s':>12}  {'max |expert bias|':>18}")
    for name, (_, tokens_per_s, state) in runs.items():
        print(f"{name:<20} {tokens_per_s:>12,.0f}  {expert_bias_range(state):>18.4f}")
    speedup = runs["ours run 1"][1] / runs["torchtitan"][1]
    print(f"ours / torchtitan tokens/s: {speedup:.3f} (run 1), {runs['ours run 2'][1] / runs['torchtitan'][1]:.3f} "
          "(run 2)")
    tail = max(1, steps // 10)
    mean_ours, mean_ref = sum(ours1[-tail:]) / tail, sum(ref[-tail:]) / tail
    gaps = [abs(a - b) for a, b in zip(train_moe.moving_average(ours1, 20), train_moe.moving_average(ref, 20))]
    worst = max(range(steps), key=lambda s: gaps[s])
    # The floor: torchtitan against itself with its experts' products rounded by another kernel.
    floor = [abs(a - b) for a, b in zip(train_moe.moving_average(loop, 20), train_moe.moving_average(ref, 20))]
    floor_worst = max(range(steps), key=lambda s: floor[s])
    print(f"floor: 20-step moving averages of torchtitan and torchtitan with its experts as one torch.mm each: "
          f"largest gap {floor[floor_worst]:.4f} at step {floor_worst}, at the end {floor[-1]:.4f}")
    bitwise = torch.equal(runs["ours run 1"][0], runs["ours run 2"][0])
    state1, state2 = runs["ours run 1"][2], runs["ours run 2"][2]
    states_equal = state1.keys() == state2.keys() and all(torch.equal(state1[k], state2[k]) for k in state1)
    checks = [
        (bitwise, "ours, two runs: losses bitwise equal"),
        (states_equal, "ours, two runs: final state dicts (parameters, expert biases) bitwise equal"),
        (abs(ours1[0] - ref[0]) < 0.02, f"first loss: ours {ours1[0]:.5f}, torchtitan {ref[0]:.5f} (within 0.02)"),
        (gaps[worst] <= 0.02, f"20-step moving averages of ours and torchtitan within 0.02 nats at every step (largest "
                              f"gap {gaps[worst]:.4f} at step {worst}; at the end {gaps[-1]:.4f})"),
        (mean_ours < 0.8 * ours1[0] and mean_ref < 0.8 * ref[0],
         f"both learned: last {tail} steps' mean ours {mean_ours:.4f}, torchtitan {mean_ref:.4f} (below 80 % of the "
         "first loss)"),
    ]
    print()
    failures = train_moe.print_checks(checks)
    train_moe.write_losses(args.out, ["ours_run_1", "ours_run_2", "torchtitan", "torchtitan_mm_loop"],
                           [ours1, ours2, ref, loop])
    path = os.path.join(args.out, "loss_curves.png")
    curves = [("torchtitan's experts", ref, "#e6550d", False),
              ("torchtitan's experts, one torch.mm each", loop, "#fdae6b", True), ("mok, run 1", ours1, "#3182bd", False),
              ("mok, run 2 (bitwise equal)" if bitwise else "mok, run 2", ours2, "#08306b", True)]
    title = (f"torchtitan DeepSeek-V3 {FLAVOR}, {args.shared_experts} shared expert(s), "
             f"{'compiled per block' if args.compile else 'eager'}, 1 GPU")
    renderer = train_moe.plot_losses(path, curves, title)
    print(f"loss curves: {path} (drawn by {renderer})")
    return failures


def main():
    args = make_parser().parse_args()
    try:
        device = mok.require_hopper()  # before any CUDA call: "mok needs an NVIDIA Hopper GPU ..."
    except RuntimeError as e:
        if not str(e).startswith(mok.device.HOPPER_REQUIRED):
            raise
        raise SystemExit(f"torchtitan_moe: {e}") from None
    torch.cuda.set_device(device)
    titan = import_torchtitan()
    import torchtitan
    torch.use_deterministic_algorithms(True, warn_only=True)
    config = model_config(args, titan[4])
    print(f"torchtitan_moe: torchtitan {torchtitan.__version__} DeepSeek-V3 {FLAVOR} ({len(config.layers)} layers, "
          f"{args.shared_experts} shared expert(s)), {args.batch} x {args.seq} tokens per step, {args.steps} steps, "
          f"{'torch.compile per block' if args.compile else 'eager'}, torch {torch.__version__}", flush=True)
    data = train_moe.make_data(args.steps, args.batch, args.seq, args.seed, 0, device)
    state = build_model(config, device, seed=args.seed).state_dict()
    runs = {}
    for name, kind in RUNS:
        t0 = time.perf_counter()
        runs[name] = train(kind, args, titan, config, state, data, device)
        print(f"{name}: {args.steps} steps in {time.perf_counter() - t0:.1f} s, final loss "
              f"{runs[name][0][-1].item():.4f}", flush=True)
    failures = report(args, runs)
    if failures:
        print(f"\n{len(failures)} check(s) failed")
        sys.exit(1)
    print("\nall checks passed")


if __name__ == "__main__":
    main()
