#!/usr/bin/env python3
"""Trains a small mixture-of-experts transformer with mok.MoE as its FFN, next to the same model written in
plain PyTorch, and checks that the two learn alike and that ours is reproducible bit for bit.

    python3 examples/train_moe.py [--steps 300] [--layers 4] [--out DIR]           # 1 GPU, EP = 1
    torchrun --nproc-per-node N examples/train_moe.py [...]                        # EP = N (N GPUs)

The task (generated, the same for every run): token sequences of an order-2 Markov chain over a vocabulary of
64, next = TABLE[previous, current] with probability 0.8 and uniform otherwise; the model must attend to the
previous token and memorize the 4096-entry table (the loss falls from ln 64 = 4.16 towards the chain's entropy,
1.31 nats). The model: token and position embeddings, --layers blocks of (RMSNorm, causal self-attention,
RMSNorm, MoE FFN: router + top-k routed SwiGLU experts + a shared expert), RMSNorm, LM head; bf16 parameters,
fp32 master weights in AdamW. Runs:
  ours, twice   the FFN is mok.MoE (EP over all processes, one workspace shared by the layers), in --precision
                (bf16, or fp8: DeepSeek-V3's block-scaled e4m3, weights quantized again after every step);
  ours bf16     --precision fp8 only: ours once more in bf16, from the same seed and data;
  torch         the same model and initial values, the FFN a reference MoE in torch ops (sort by expert,
                one matmul per expert, fp32 combine; every rank holds every expert).
Checks (exit status 1 if one fails): the two runs of ours give bitwise equal losses and final parameters; ours
and torch start at the same loss (within 0.02) and end within 5 % (mean of the last 10 % of the steps), and both
learned (that mean below 80 % of the first loss); with --precision fp8, the 20-step moving averages of the fp8
and bf16 runs within 0.02 nats at every step. Prints a loss table and tokens/s of each run; writes
DIR/losses.csv and DIR/loss_curves.png (drawn by matplotlib when it imports, else by the repository's built-in PNG
renderer, bench/png_canvas.py). Needs an NVIDIA Hopper GPU per process (it says so and stops otherwise; --help
works anywhere). With EP = N each rank trains on its own batch;
replicated parameters' gradients are averaged over the ranks, the routed experts' divided by N (the loss is the
mean over ranks). The whole example is deterministic: ops with atomics are avoided (the embedding is a one-hot
matmul) and torch's deterministic algorithms are asked for.
"""
import argparse
import csv
import math
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before torch loads it)
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mok  # noqa: E402

VOCAB = 64
FOLLOW_TABLE = 0.8  # probability that the next token is TABLE[previous, current]
FP8_GAP_NATS = 0.02  # --precision fp8: the largest gap of the 20-step moving averages against ours in bf16


def positive_int(text: str) -> int:
    """argparse type: an int > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def make_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=300,
                   help="optimizer steps of each run (the first 10 are not timed)")
    p.add_argument("--layers", type=positive_int, default=4, help="transformer blocks, each with its own MoE FFN")
    p.add_argument("--out", default="train_moe_out", help="folder for losses.csv and loss_curves.png")
    p.add_argument("--batch", type=positive_int, default=16, help="sequences per step per rank")
    p.add_argument("--seq", type=positive_int, default=128,
                   help="tokens per sequence (batch * seq: mok.MoE's tokens per call)")
    p.add_argument("--hidden", type=positive_int, default=256, help="model width H (a multiple of 64)")
    p.add_argument("--intermediate", type=positive_int, default=256,
                   help="width I of each expert and of the shared expert (a multiple of 64)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads (must divide --hidden)")
    p.add_argument("--experts", type=positive_int, default=8,
                   help="routed experts E (a multiple of the number of processes)")
    p.add_argument("--top-k", type=positive_int, default=2, help="experts per token (at most --experts)")
    p.add_argument("--lr", type=positive_float, default=2e-3, help="AdamW's peak learning rate (10 warm-up steps, "
                   "then cosine down to a tenth)")
    p.add_argument("--seed", type=int, default=1, help="seed of the data and of the initial parameters")
    p.add_argument("--load-factor", type=float, default=0,
                   help="mok.Config.load_factor (0: the EP size, the worst case, which never overflows: no balance "
                   "loss keeps this router's load even)")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                   help="ours' precision (mok.Config.precision). fp8: DeepSeek-V3's block-scaled e4m3, and a third "
                   "run of ours in bf16 from the same seed and data, whose loss curve the fp8 one must follow (the "
                   "20-step moving averages within 0.02 nats); --intermediate a multiple of 128")
    p.add_argument("--bf16-weight-gradients", action="store_true",
                   help="with --precision fp8: the weight gradients' GEMMs in bf16 (mok.Config.bf16_weight_gradients; "
                   "default: FP8 too, DeepSeek-V3's recipe)")
    p.add_argument("--fp8-weight-gradient-columns", action="store_true",
                   help="with --precision fp8 and FP8 weight gradients: x and h scaled per column per 128 rows in "
                   "them, DeepSeek-V3's recipe (mok.Config.fp8_weight_gradient_columns; default: per 128 x 128 block)")
    p.add_argument("--main-grad", action="store_true",
                   help="ours accumulates its expert weight gradients into fp32 param.main_grad (Megatron's way)")
    return p


def parse_args(argv=None):
    """The options, each checked (argparse's usage error, exit status 2, naming the option); the layer's own rules
    (multiples of 64, E a multiple of the processes) are mok's, checked when the model is built."""
    p = make_parser()
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden}")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} must be at most --experts {args.experts}")
    if args.bf16_weight_gradients and args.precision != "fp8":
        p.error("--bf16-weight-gradients needs --precision fp8")
    if args.fp8_weight_gradient_columns and (args.precision != "fp8" or args.bf16_weight_gradients):
        p.error("--fp8-weight-gradient-columns needs --precision fp8 and FP8 weight gradients (no "
                "--bf16-weight-gradients)")
    if args.precision == "fp8" and args.intermediate % 128:
        p.error(f"--precision fp8 needs --intermediate a multiple of 128 (the FP8 backward's blocks), got "
                f"{args.intermediate}")
    if args.load_factor != 0 and not args.load_factor >= 1:
        p.error(f"--load-factor must be 0 (the EP size) or a number >= 1, got {args.load_factor}")
    return args


# ---------------------------------------------------------------------------------------------------------------
# Data


def make_data(steps, batch, seq, seed, rank, device):
    """int64 [steps, batch, seq + 1] token sequences of the order-2 chain (inputs [:, :, :-1], targets [:, :, 1:]);
    the table is the same on every rank, the sequences are the rank's own."""
    table_gen = torch.Generator(device="cpu").manual_seed(seed)
    table = torch.randint(0, VOCAB, (VOCAB, VOCAB), generator=table_gen).to(device)
    gen = torch.Generator(device="cpu").manual_seed(seed * 1000 + 17 + rank)
    n = steps * batch
    tokens = torch.empty(n, seq + 1, dtype=torch.int64)
    tokens[:, :2] = torch.randint(0, VOCAB, (n, 2), generator=gen)
    follow = torch.rand(n, seq + 1, generator=gen) < FOLLOW_TABLE
    noise = torch.randint(0, VOCAB, (n, seq + 1), generator=gen)
    tokens, follow, noise = tokens.to(device), follow.to(device), noise.to(device)
    for t in range(2, seq + 1):
        tokens[:, t] = torch.where(follow[:, t], table[tokens[:, t - 2], tokens[:, t - 1]], noise[:, t])
    return tokens.view(steps, batch, seq + 1)


# ---------------------------------------------------------------------------------------------------------------
# The model (shared by both runs; only the FFN differs)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=torch.bfloat16, device=device))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class Block(torch.nn.Module):
    def __init__(self, hidden, heads, ffn, device):
        super().__init__()
        bf16 = dict(dtype=torch.bfloat16, device=device)
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(hidden, device), RMSNorm(hidden, device)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False, **bf16)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False, **bf16)
        self.ffn = ffn

    def attention(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(h // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1).to(x.dtype)
        return self.proj((probs @ v).transpose(1, 2).reshape(b, s, h))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class Model(torch.nn.Module):
    def __init__(self, args, ffns, device):
        super().__init__()
        bf16 = dict(dtype=torch.bfloat16, device=device)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, args.hidden, **bf16) * 0.5)
        self.position = torch.nn.Parameter(torch.randn(args.seq, args.hidden, **bf16) * 0.1)
        self.blocks = torch.nn.ModuleList(Block(args.hidden, args.heads, ffn, device) for ffn in ffns)
        self.norm = RMSNorm(args.hidden, device)
        self.head = torch.nn.Linear(args.hidden, VOCAB, bias=False, **bf16)

    def forward(self, tokens):
        # One-hot matmul instead of an embedding lookup: its backward is a matmul, not an atomic scatter.
        x = F.one_hot(tokens, VOCAB).to(self.embed.dtype) @ self.embed + self.position
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TorchMoE(torch.nn.Module):
    """The reference FFN in torch ops, with mok.MoE's parameters (names and shapes, all experts) and router."""

    def __init__(self, args, device):
        super().__init__()
        e, h, i = args.experts, args.hidden, args.intermediate
        bf16 = dict(dtype=torch.bfloat16, device=device)
        self.top_k = args.top_k
        self.router = torch.nn.Linear(h, e, bias=False, **bf16)
        for name, shape in (("expert_gate", (e, i, h)), ("expert_up", (e, i, h)), ("expert_down", (e, h, i)),
                            ("shared_gate", (i, h)), ("shared_up", (i, h)), ("shared_down", (h, i))):
            bound = 1.0 / math.sqrt(shape[-1])
            setattr(self, name, torch.nn.Parameter(torch.empty(shape, **bf16).uniform_(-bound, bound)))

    @staticmethod
    def mlp(rows, gate, up, down):
        hidden = (F.silu((rows @ gate.T).float()) * (rows @ up.T).float()).to(rows.dtype)
        return hidden @ down.T

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        t, k = tokens.shape[0], self.top_k
        logits = F.linear(tokens.float(), self.router.weight.float())
        router_weights, topk_idx = torch.softmax(logits, dim=-1).topk(k, dim=-1)
        order = topk_idx.flatten().argsort(stable=True)  # routes sorted by expert, token order inside
        counts = torch.bincount(topk_idx.flatten(), minlength=self.expert_gate.shape[0]).tolist()  # one host sync
        rows = tokens[order // k]
        outputs, start = [], 0
        for e, count in enumerate(counts):
            if count:
                outputs.append(self.mlp(rows[start:start + count], self.expert_gate[e], self.expert_up[e],
                                        self.expert_down[e]))
            start += count
        routed = torch.cat(outputs)[order.argsort()].view(t, k, -1)  # back to (token, slot) order
        out = self.mlp(tokens, self.shared_gate, self.shared_up, self.shared_down).float()
        out = out + (router_weights.unsqueeze(-1) * routed.float()).sum(1)
        return out.to(x.dtype).view(x.shape)


# ---------------------------------------------------------------------------------------------------------------
# Training


class MixedPrecisionAdamW:
    """AdamW on fp32 master copies of bf16 parameters: the gradient (param.main_grad if the parameter has one,
    else param.grad; zeros if none) is read into the master's, the step runs in fp32, the bf16 parameter is
    rounded from the master."""

    def __init__(self, params, lr):
        self.params = list(params)
        self.master = [p.detach().float().clone() for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, betas=(0.9, 0.95), weight_decay=0.01, foreach=True)

    def step(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for p, m in zip(self.params, self.master):
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            m.grad = torch.zeros_like(m) if g is None else g.float().clone()
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)

    def zero_grad(self):
        for p in self.params:
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()


def learning_rate(args, step):
    warmup = 10
    if step < warmup:
        return args.lr * (step + 1) / warmup
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup))))


class Dist:
    """This process's place: EP = 1 without torchrun, else one rank per GPU of an NCCL group."""

    def __init__(self):
        self.size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = mok.require_hopper(local)  # before any CUDA call: "mok needs an NVIDIA Hopper GPU ..."
        torch.cuda.set_device(self.device)
        self.group = None
        if self.size > 1:
            import torch.distributed as dist
            dist.init_process_group("nccl", device_id=self.device)
            self.group = dist.group.WORLD

    def mean(self, t):
        if self.size > 1:
            import torch.distributed as dist
            dist.all_reduce(t)
            t.div_(self.size)
        return t

    def print(self, *a):
        if self.rank == 0:
            print(*a, flush=True)


def initial_state(args, device):
    """The initial parameters, the same on every rank: the torch model's (all experts)."""
    torch.manual_seed(args.seed)
    return Model(args, [TorchMoE(args, device) for _ in range(args.layers)], device).state_dict()


def build(kind, args, env, state, precision="bf16"):
    """(model, its routed-expert parameters) for 'ours' (in `precision`) or 'torch', loaded with the initial
    state."""
    if kind == "torch":
        model = Model(args, [TorchMoE(args, env.device) for _ in range(args.layers)], env.device)
        model.load_state_dict(state)
        return model, []
    tokens = args.batch * args.seq
    config = mok.Config(load_factor=args.load_factor or float(env.size), precision=precision,
                        bf16_weight_gradients=args.bf16_weight_gradients,
                        fp8_weight_gradient_columns=args.fp8_weight_gradient_columns and precision == "fp8")
    ws = mok.get_workspace(config, env.group, tokens, args.hidden, args.intermediate, args.top_k, args.experts)
    ffns = [mok.MoE(args.hidden, args.intermediate, args.experts, args.top_k, workspace=ws, group=env.group,
                    main_grad=args.main_grad) for _ in range(args.layers)]
    model = Model(args, ffns, env.device)
    local = args.experts // env.size
    mine = {}
    for name, value in state.items():
        if name.split(".")[-1] in ("expert_gate", "expert_up", "expert_down"):
            value = value[env.rank * local:(env.rank + 1) * local]  # this rank's experts
        mine[name] = value
    model.load_state_dict(mine)
    experts = [p for ffn in ffns for p in (ffn.expert_gate, ffn.expert_up, ffn.expert_down)]
    if args.main_grad:
        for ffn in ffns:
            ffn.allocate_main_grads()
    return model, experts


def train(kind, args, env, state, data, precision="bf16"):
    """Losses [steps] (fp32, mean over ranks), tokens/s after the first 10 steps, the final parameters."""
    model, experts = build(kind, args, env, state, precision)
    expert_ids = {id(p) for p in experts}
    optimizer = MixedPrecisionAdamW(model.parameters(), args.lr)
    losses = torch.zeros(args.steps, device=env.device)
    timed_from = min(10, args.steps - 1)
    for step in range(args.steps):
        if step == timed_from:
            torch.cuda.synchronize()
            start = time.perf_counter()
        batch = data[step]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), batch[:, 1:].reshape(-1))
        loss.backward()
        if env.size > 1:  # the loss is the mean over ranks: average replicated gradients, scale the experts'
            for p in model.parameters():
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                if g is None:
                    continue
                if id(p) in expert_ids:
                    g.div_(env.size)
                else:
                    env.mean(g)
        optimizer.step(learning_rate(args, step))
        optimizer.zero_grad()
        losses[step] = env.mean(loss.detach().clone())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens_per_s = (args.steps - timed_from) * args.batch * args.seq * env.size / elapsed
    if kind == "ours":
        for ffn in (b.ffn for b in model.blocks):
            mok.check_status(ffn.workspace)
        model.blocks[0].ffn.workspace.close()  # shared by the layers; collective with EP > 1: every rank, here
    params = [p.detach().clone() for p in model.parameters()]
    return losses.cpu(), tokens_per_s, params


def moving_average(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def report(args, env, runs):
    """Prints the table and the checks; writes the CSV and the PNG. Returns the failed checks."""
    ours1, ours2, ref = (runs[k][0].tolist() for k in ("ours run 1", "ours run 2", "torch"))
    bf16 = runs["ours bf16"][0].tolist() if "ours bf16" in runs else None
    steps = len(ours1)
    extra = f" {'ours bf16':>12} {'fp8 - bf16':>11}" if bf16 else ""
    env.print(f"\n{'step':>6} {'ours run 1':>12} {'ours run 2':>12} {'torch':>12} {'ours - torch':>13}{extra}")
    for s in sorted(set(list(range(0, steps, max(1, steps // 15))) + [steps - 1])):
        extra = f" {bf16[s]:>12.5f} {ours1[s] - bf16[s]:>+11.5f}" if bf16 else ""
        env.print(f"{s:>6} {ours1[s]:>12.5f} {ours2[s]:>12.5f} {ref[s]:>12.5f} {ours1[s] - ref[s]:>+13.5f}{extra}")
    env.print(f"\n{'run':<12} {'tokens/s':>12}")
    for name, (_, tokens_per_s, _) in runs.items():
        env.print(f"{name:<12} {tokens_per_s:>12,.0f}")
    tail = max(1, steps // 10)
    mean_ours, mean_ref = sum(ours1[-tail:]) / tail, sum(ref[-tail:]) / tail
    smooth_gap = max(abs(a - b) for a, b in zip(moving_average(ours1, 20), moving_average(ref, 20)))
    bitwise = torch.equal(runs["ours run 1"][0], runs["ours run 2"][0])
    params_equal = all(torch.equal(a, b) for a, b in zip(runs["ours run 1"][2], runs["ours run 2"][2]))
    checks = [
        (bitwise, "ours, two runs: losses bitwise equal"),
        (params_equal, "ours, two runs: final parameters bitwise equal"),
        (abs(ours1[0] - ref[0]) < 0.02, f"first loss: ours {ours1[0]:.5f}, torch {ref[0]:.5f} (within 0.02)"),
        (abs(mean_ours - mean_ref) < 0.05 * mean_ref,
         f"last {tail} steps' mean: ours {mean_ours:.4f}, torch {mean_ref:.4f} (within 5 %)"),
        (mean_ours < 0.8 * ours1[0] and mean_ref < 0.8 * ref[0], "both learned (last mean < 80 % of the first loss)"),
    ]
    env.print(f"\nlargest gap of the 20-step moving averages: {smooth_gap:.4f}")
    if bf16:  # FP8 against ours in BF16, same seed and data (DeepSeek-V3's bar for the recipe: curves that overlap)
        fp8_gap = max(abs(a - b) for a, b in zip(moving_average(ours1, 20), moving_average(bf16, 20)))
        floor = max(abs(a - b) for a, b in zip(moving_average(bf16, 20), moving_average(ref, 20)))
        env.print(f"largest gap of the 20-step moving averages, fp8 - bf16: {fp8_gap:.4f} (bf16 - torch, two bf16 "
                  f"roundings of one model: {floor:.4f})")
        checks.append((fp8_gap <= FP8_GAP_NATS, f"fp8 against bf16: largest 20-step moving-average gap "
                                                f"{fp8_gap:.4f} nats (at most {FP8_GAP_NATS})"))
    failures = print_checks(checks, env.print)
    if env.rank == 0:
        names, columns = ["ours_run_1", "ours_run_2", "torch"], [ours1, ours2, ref]
        if bf16:
            names, columns = names + ["ours_bf16"], columns + [bf16]
        write_losses(args.out, names, columns)
        path = os.path.join(args.out, "loss_curves.png")
        run = f"mok.MoE {args.precision}" if bf16 else "mok.MoE"
        curves = [("plain PyTorch MoE", ref, "#e6550d", False), (f"{run}, run 1", ours1, "#3182bd", False),
                  (f"{run}, run 2 (bitwise equal)" if bitwise else f"{run}, run 2", ours2, "#08306b", True)]
        if bf16:
            curves.append(("mok.MoE bf16", bf16, "#31a354", False))
        title = f"{args.layers}-layer MoE transformer, EP = {env.size}, E = {args.experts}, k = {args.top_k}"
        renderer = plot_losses(path, curves, title)
        print(f"loss curves: {path} (drawn by {renderer})")
    return failures


# ---------------------------------------------------------------------------------------------------------------
# The loss curves' PNG: matplotlib when it imports, else the repository's built-in renderer (bench/png_canvas.py,
# as bench/chart_png.py and tools/timeline_png.py fall back to it), the same picture and pixel size.

PLOT_WIDTH_PX, PLOT_HEIGHT_PX, PLOT_DPI = 960, 540, 120
RENDERERS = ("auto", "matplotlib", "builtin")


def print_checks(checks, print_line=print):
    """Prints each (ok, what) check as PASS / FAIL; returns the failed ones' texts."""
    for ok, what in checks:
        print_line(f"{'PASS' if ok else 'FAIL'}  {what}")
    return [what for ok, what in checks if not ok]


def write_losses(folder, names, runs):
    """folder/losses.csv: a step column, then one column per run (names, runs: lists of per-step losses)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "losses.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *names])
        w.writerows([step, *losses] for step, losses in enumerate(zip(*runs)))


def plot_losses(path, curves, title, renderer="auto"):
    """Draws the loss curves to the PNG `path`; returns the renderer that drew it ("matplotlib" or "builtin").
    curves: (label, losses per step, colour "#rrggbb", dashed) each; renderer: auto (matplotlib when it imports),
    matplotlib or builtin."""
    if renderer not in RENDERERS:
        raise ValueError(f"renderer: expected one of {RENDERERS}, got {renderer!r}")
    if renderer != "builtin":
        try:
            import matplotlib
        except ImportError:
            if renderer == "matplotlib":
                raise
        else:
            matplotlib.use("Agg")
            _plot_matplotlib(path, curves, title)
            return "matplotlib"
    _plot_builtin(path, curves, title)
    return "builtin"


def _plot_matplotlib(path, curves, title):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(PLOT_WIDTH_PX / PLOT_DPI, PLOT_HEIGHT_PX / PLOT_DPI), dpi=PLOT_DPI)
    for label, losses, colour, dashed in curves:
        ax.plot(losses, label=label, color=colour, linewidth=1, linestyle=(0, (4, 4)) if dashed else "solid")
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _png_canvas():
    """bench/png_canvas.py of this repository (found relative to this file)."""
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import png_canvas
    return png_canvas


# The built-in renderer's layout in pixels.
PLOT_LEFT_PX, PLOT_RIGHT_PX, PLOT_TOP_PX, PLOT_BOTTOM_PX = 90, 24, 64, 60
LINE_PX, DASH_PX, GAP_PX = 2, 8, 6
TEXT_SCALE = 2
TEXT_COLOUR, AXIS_COLOUR, GRID_COLOUR = "#000000", "#404040", "#e0e0e0"


def _axis(low, high, targets):
    """(first tick, step, last tick) covering [low, high] with about `targets` intervals."""
    pc = _png_canvas()
    step = pc.nice_step(max(high - low, 1e-9), targets)
    return math.floor(low / step) * step, step, math.ceil(high / step) * step


def _plot_builtin(path, curves, title):
    pc = _png_canvas()
    canvas = pc.Canvas(PLOT_WIDTH_PX, PLOT_HEIGHT_PX)
    left, top = PLOT_LEFT_PX, PLOT_TOP_PX
    right, bottom = PLOT_WIDTH_PX - PLOT_RIGHT_PX, PLOT_HEIGHT_PX - PLOT_BOTTOM_PX
    text_px = pc.text_height(TEXT_SCALE)
    scale = pc.fit_scale(title, PLOT_WIDTH_PX - 16, TEXT_SCALE)
    canvas.text(PLOT_WIDTH_PX / 2, 10, title, TEXT_COLOUR, scale, "centre")
    canvas.text(left, top - text_px - 8, "cross-entropy (nats)", TEXT_COLOUR, TEXT_SCALE)
    finite = [v for _, losses, _, _ in curves for v in losses if math.isfinite(v)]
    steps = max((len(losses) for _, losses, _, _ in curves), default=1)
    low, high = min(finite, default=0.0), max(finite, default=1.0)
    if high - low < 1e-6 * max(1.0, abs(high)):  # one value: an axis of one around it
        low, high = low - 0.5, high + 0.5
    y_low, y_step, y_high = _axis(low, high, 6)
    x_low, x_step, x_high = _axis(0, max(steps - 1, 1), 8)

    def x_of(step):
        return left + (step - x_low) / (x_high - x_low) * (right - left)

    def y_of(value):
        return bottom - (value - y_low) / (y_high - y_low) * (bottom - top)

    for i in range(round((y_high - y_low) / y_step) + 1):
        value = y_low + i * y_step
        y = round(y_of(value))
        canvas.hline(left, right, y, GRID_COLOUR)
        canvas.text(left - 8, y - text_px / 2, f"{value:g}", TEXT_COLOUR, TEXT_SCALE, "right")
    for i in range(round((x_high - x_low) / x_step) + 1):
        value = x_low + i * x_step
        x = round(x_of(value))
        canvas.vline(x, top, bottom, GRID_COLOUR)
        canvas.text(x, bottom + 8, f"{value:g}", TEXT_COLOUR, TEXT_SCALE, "centre")
    canvas.text((left + right) / 2, bottom + 16 + text_px, "step", TEXT_COLOUR, TEXT_SCALE, "centre")
    canvas.vline(left, top, bottom + 1, AXIS_COLOUR)
    canvas.hline(left, right, bottom, AXIS_COLOUR)
    for _, losses, colour, dashed in curves:
        points = [(x_of(s), y_of(v)) if math.isfinite(v) else None for s, v in enumerate(losses)]
        _polyline(canvas, points, colour, dashed)
    _legend(canvas, pc, curves, right - 12, top + 12)
    canvas.save(path)


def _polyline(canvas, points, colour, dashed):
    """Straight segments between consecutive points (None: a gap, e.g. a NaN loss), LINE_PX thick; dashed: DASH_PX
    drawn, GAP_PX left out, along the line's length."""
    travelled = 0.0
    for a, b in zip(points, points[1:]):
        if a is None or b is None:
            continue
        length = math.hypot(b[0] - a[0], b[1] - a[1])
        dots = max(1, math.ceil(length))
        for i in range(dots + 1):
            if dashed and (travelled + length * i / dots) % (DASH_PX + GAP_PX) >= DASH_PX:
                continue
            x, y = a[0] + (b[0] - a[0]) * i / dots, a[1] + (b[1] - a[1]) * i / dots
            canvas.fill_rect(round(x - LINE_PX / 2), round(y - LINE_PX / 2), round(x - LINE_PX / 2) + LINE_PX,
                             round(y - LINE_PX / 2) + LINE_PX, colour)
        travelled += length


def _legend(canvas, pc, curves, right, top):
    """A box in the plot's top-right corner: a line swatch and the label of each curve."""
    swatch, gap, pad = 28, 8, 8
    row = pc.text_height(TEXT_SCALE) + 8
    width = swatch + gap + max(pc.text_width(label, TEXT_SCALE) for label, _, _, _ in curves) + 2 * pad
    left = right - width
    canvas.fill_rect(left, top, right, top + len(curves) * row + 2 * pad, "#ffffff")
    canvas.outline_rect(left, top, right, top + len(curves) * row + 2 * pad, GRID_COLOUR)
    for i, (label, _, colour, dashed) in enumerate(curves):
        y = top + pad + i * row + row / 2
        _polyline(canvas, [(left + pad, y), (left + pad + swatch, y)], colour, dashed)
        canvas.text(left + pad + swatch + gap, y - pc.text_height(TEXT_SCALE) / 2, label, TEXT_COLOUR,
                    TEXT_SCALE)


def main():
    args = parse_args()
    try:
        env = Dist()
    except RuntimeError as e:
        if not str(e).startswith(mok.device.HOPPER_REQUIRED):
            raise
        raise SystemExit(f"train_moe: {e}") from None
    if args.experts % env.size:
        raise SystemExit(f"--experts {args.experts} is not a multiple of the {env.size} processes")
    torch.use_deterministic_algorithms(True, warn_only=True)
    env.print(f"train_moe: {args.layers} layers, H {args.hidden}, I {args.intermediate}, E {args.experts}, "
              f"k {args.top_k}, {args.batch} x {args.seq} tokens per step per rank, EP = {env.size}, "
              f"{args.steps} steps, {args.precision}{', bf16 weight gradients' if args.bf16_weight_gradients else ''}"
              f"{', x and h per column in the FP8 weight gradients' if args.fp8_weight_gradient_columns else ''}"
              f"{', main_grad' if args.main_grad else ''}")
    data = make_data(args.steps, args.batch, args.seq, args.seed, env.rank, env.device)
    state = initial_state(args, env.device)
    runs = {}
    plan = [("ours run 1", "ours", args.precision), ("ours run 2", "ours", args.precision)]
    if args.precision != "bf16":
        plan.append(("ours bf16", "ours", "bf16"))
    for name, kind, precision in plan + [("torch", "torch", "bf16")]:
        t0 = time.perf_counter()
        runs[name] = train(kind, args, env, state, data, precision)
        env.print(f"{name}: {args.steps} steps in {time.perf_counter() - t0:.1f} s, final loss "
                  f"{runs[name][0][-1].item():.4f}")
    failures = report(args, env, runs)
    if env.size > 1:
        import torch.distributed as dist
        dist.destroy_process_group()
    if failures:
        env.print(f"\n{len(failures)} check(s) failed")
        sys.exit(1)
    env.print("\nall checks passed")


if __name__ == "__main__":
    main()
