"""Full-size model shapes (bench/gemm_bench.py's SHAPES, T = 8192 tokens, EP = 1) through mok.forward and
mok.backward (fused path, bf16 gradients), against an fp32 PyTorch reference on samples (marker gpu; skipped with
the reason without a Hopper GPU, without the extension, or without the GPU memory a shape needs).

Per shape: x, d_out ~ N(0, 1) bf16; weights ~ N(0, 1/fan_in) bf16 (separate gate and up, the default layout);
top-k of random logits with softmax router weights over the chosen ones (fp32); every 61st token's last route
masked (-1). The reference upcasts the bf16 tensors and computes in fp32 (TF32 off, torch's default):
- 64 sampled tokens (0 and 61 among them, so masked routes): out, d_x and d_router_weights. Budget per element
  |ours - ref| <= 2^-6 (|ref| + rms(ref's row)), the C++ backward test's (docs/design.md, "Backward"): the GPU
  rounds g, u, h, dy, d_g, d_u, the d_x partials and the outputs to bf16 (2^-9 relative each). A masked route's
  d_router_weights must be exactly 0.
- 128 x 128 tiles of dW_gate, dW_up (rows: intermediate) and dW_down (rows: hidden) of the first, a random middle
  and the last expert (the last at the matrices' far corner, so partial GEMM tiles), the fp32 sum over every
  route to that expert; and of the shared expert over all T tokens. Budget: relative Frobenius error <= 3e-2
  (bf16 gradients).
Ratios are error / budget: <= 1 passes, NaN fails. pytest -s prints one line of the worst ratios per shape.
DeepSeek-V4-Pro runs with half its experts (192), so its bf16 weights and gradients take 51 GB rather than 102 GB
(with the workspace, poison and references near an H200's 139 GiB less what else runs); Kimi-K2.7 runs whole
(34 + 34 GB). Each shape checks its free GPU memory first and skips, saying so, when short.
"""
import gc
import random

import pytest
import torch

import mok
from test_autograd import poison_free_memory

pytestmark = pytest.mark.gpu

T = 8192
TOKEN_SAMPLES = 64
TILE = 128
TOKEN_BUDGET = 2.0 ** -6  # of |ref| + rms(ref row), per element
TILE_BUDGET = 3e-2  # relative Frobenius error of a weight-gradient tile
MASK_EVERY = 61  # tokens 0, 61, 122, ... have their last route masked
SHAPES = [  # bench/gemm_bench.py's: name, experts, hidden, intermediate, top_k, shared expert (of width I)
    ("Kimi-K2.7", 384, 7168, 2048, 8, True),
    ("GLM-5.2", 256, 6144, 2048, 8, True),
    ("Qwen3.5-397B", 512, 4096, 1024, 10, True),
    ("DeepSeek-V4-Pro", 192, 7168, 3072, 6, True),  # half of its 384 experts (see the header)
    ("gpt-oss-120b", 128, 2880, 2880, 4, False),  # H and I not multiples of the GEMM tiles
    ("Qwen3-30B-A3B", 128, 2048, 768, 8, False),
]


def make_case(experts, hidden, inter, top_k, shared, seed, device="cuda"):
    """(x, topk_idx, router_weights, weights, d_out) as the header describes."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*dims, dtype=torch.bfloat16):
        return torch.randn(*dims, generator=gen, device=device, dtype=dtype)

    def weight(*dims):
        return randn(*dims).mul_(dims[-1] ** -0.5)  # in place: no fp32 copy of 10+ GB tensors

    w = mok.Weights(weight(experts, inter, hidden), weight(experts, inter, hidden), weight(experts, hidden, inter),
                    *((weight(inter, hidden), weight(inter, hidden), weight(hidden, inter)) if shared else (None,) * 3))
    x, d_out = randn(T, hidden), randn(T, hidden)
    chosen, idx = randn(T, experts, dtype=torch.float32).topk(top_k, dim=1)
    idx = idx.to(torch.int32).contiguous()
    idx[::MASK_EVERY, top_k - 1] = -1
    return x, idx, torch.softmax(chosen, dim=1).contiguous(), w, d_out


def mlp_with_grad(x, dy, gate, up, down):
    """fp32 SwiGLU MLP on rows x [n, H] (fp32) with output gradient dy [n, H]: (y, d_x)."""
    gate, up, down = gate.float(), up.float(), down.float()
    g, u = x @ gate.T, x @ up.T
    s = torch.sigmoid(g)
    dh = dy @ down
    d_g, d_u = dh * u * s * (1 + g * (1 - s)), dh * g * s  # silu'(g) = s (1 + g (1 - s)), silu(g) = g s
    return (g * s * u) @ down.T, d_g @ gate + d_u @ up


def token_reference(x, idx, rw, w, d_out, tokens):
    """fp32 (out, d_x, d_router_weights) rows of `tokens`, routed expert by expert (vectorized per expert)."""
    xs, ds, ids, rws = x[tokens].float(), d_out[tokens].float(), idx[tokens].long(), rw[tokens]
    out, d_x = torch.zeros_like(xs), torch.zeros_like(xs)
    if w.shared_gate is not None:
        out, d_x = mlp_with_grad(xs, ds, w.shared_gate, w.shared_up, w.shared_down)
    d_rw = torch.zeros_like(rws)
    for e in ids[ids >= 0].unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        r = rws[rows, slots, None]
        y, dx = mlp_with_grad(xs[rows], r * ds[rows], w.expert_gate[e], w.expert_up[e], w.expert_down[e])
        out.index_add_(0, rows, r * y)
        d_x.index_add_(0, rows, dx)
        d_rw[rows, slots] = (ds[rows] * y).sum(1)
    return out, d_x, d_rw


def tile_reference(x, dy, gate, up, down, ci, ch):
    """fp32 weight-gradient tiles of one MLP summed over the rows x [n, H] with output gradient dy [n, H]:
    dW_gate[ci, ch], dW_up[ci, ch], dW_down[ch, ci] (ci, ch: slices of the intermediate and hidden indices)."""
    g, u = x @ gate[ci].float().T, x @ up[ci].float().T
    s = torch.sigmoid(g)
    dh = dy @ down[:, ci].float()
    d_g, d_u = dh * u * s * (1 + g * (1 - s)), dh * g * s
    return d_g.T @ x[:, ch], d_u.T @ x[:, ch], dy[:, ch].T @ (g * s * u)


def token_ratio(got, ref):
    """max over elements of |got - ref| / (TOKEN_BUDGET (|ref| + rms of ref's row)); NaN if got has one."""
    rms = ref.pow(2).mean(1, keepdim=True).sqrt()
    return ((got.float() - ref).abs() / (TOKEN_BUDGET * (ref.abs() + rms))).max().item()


def tile_ratio(got, ref):
    return ((got.float() - ref).norm() / ref.norm()).item() / TILE_BUDGET


def tile_ratios(x, idx, rw, w, d_out, grads, seed):
    """{what: ratio} of the sampled weight-gradient tiles: three experts' and the shared expert's."""
    experts, inter, hidden = w.expert_gate.shape
    pick = random.Random(seed)

    def corner():
        return pick.randrange(inter - TILE + 1), pick.randrange(hidden - TILE + 1)

    cases = [(0, corner()), (pick.randrange(1, experts - 1), corner()), (experts - 1, (inter - TILE, hidden - TILE))]
    if w.shared_gate is not None:
        cases.append(("shared", corner()))
    ratios = {}
    for e, (i0, h0) in cases:
        ci, ch = slice(i0, i0 + TILE), slice(h0, h0 + TILE)
        if e == "shared":
            mats = (w.shared_gate, w.shared_up, w.shared_down)
            ours = (grads.shared_gate, grads.shared_up, grads.shared_down)
            rows, dy = x.float(), d_out.float()
        else:
            mats = (w.expert_gate[e], w.expert_up[e], w.expert_down[e])
            ours = (grads.expert_gate[e], grads.expert_up[e], grads.expert_down[e])
            tokens, slots = (idx == e).nonzero(as_tuple=True)
            assert tokens.numel() > 0, f"expert {e} got no routes (seed {seed})"
            rows, dy = x[tokens].float(), rw[tokens, slots, None] * d_out[tokens].float()
        refs = tile_reference(rows, dy, *mats, ci, ch)
        for name, got, ref in zip(("dW_gate", "dW_up", "dW_down"), ours, refs):
            tile = got[ch, ci] if name == "dW_down" else got[ci, ch]
            where = f"[{h0}:, {i0}:]" if name == "dW_down" else f"[{i0}:, {h0}:]"
            ratios[f"{'shared' if e == 'shared' else f'expert {e}'} {name}{where}"] = tile_ratio(tile, ref)
    return ratios


def run_case(experts, hidden, inter, top_k, shared, seed):
    """Our forward and backward at this shape and the ratios of the samples ({what: ratio}); everything it
    allocates is freed when it returns."""
    x, idx, rw, w, d_out = make_case(experts, hidden, inter, top_k, shared, seed)
    ws = mok.get_workspace(mok.Config(), None, T, hidden, inter, top_k, experts, shared_expert=shared)
    poison_free_memory(1024)
    out, ctx = mok.forward(ws, x, idx, rw, w)
    poison_free_memory(1024)
    d_x, d_rw, grads = mok.backward(ws, d_out, x, idx, rw, w, ctx)
    mok.check_status(ws)
    tokens = torch.cat([torch.tensor([0, MASK_EVERY]),
                        torch.randperm(T, generator=torch.Generator().manual_seed(seed))[:TOKEN_SAMPLES - 2]]).cuda()
    refs = token_reference(x, idx, rw, w, d_out, tokens)
    ratios = {name: token_ratio(got[tokens], ref)
              for name, got, ref in zip(("out", "d_x", "d_rw"), (out, d_x, d_rw), refs)}
    ratios["masked d_rw nonzero"] = (d_rw[idx < 0] != 0).sum().item()  # a count: exactly 0 required
    ratios.update(tile_ratios(x, idx, rw, w, d_out, grads, seed))
    return ratios


def worst(ratios):
    """The (what, ratio) of the largest ratio, NaN first."""
    return max(ratios.items(), key=lambda kv: float("inf") if kv[1] != kv[1] else kv[1])


@pytest.mark.parametrize("name, experts, hidden, inter, top_k, shared", SHAPES, ids=[s[0] for s in SHAPES])
def test_full_size_layer_matches_fp32_samples(name, experts, hidden, inter, top_k, shared):
    pytest.importorskip("mok._mok", reason="the extension mok._mok is not built (pip install . from the repository)")
    need = 2 * 3 * (experts + shared) * hidden * inter * 2 + (8 << 30)  # weights, gradients, workspace and slack
    free = torch.cuda.mem_get_info()[0]
    if free < need:
        pytest.skip(f"{name}: needs about {need / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    seed = 100 + [s[0] for s in SHAPES].index(name)
    try:
        ratios = run_case(experts, hidden, inter, top_k, shared, seed)
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    tiles = {k: v for k, v in ratios.items() if "dW" in k}
    line = (f"{name} (E={experts} H={hidden} I={inter} k={top_k} T={T}, seed {seed}) error/budget: "
            + ", ".join(f"{k} {ratios[k]:.3f}" for k in ("out", "d_x", "d_rw"))
            + ", worst tile {} {:.3f}".format(*worst(tiles)))
    print(line)
    failed = [k for k, v in ratios.items() if not v <= (0 if k.startswith("masked") else 1)]
    assert not failed, f"{line}; over budget: " + ", ".join(f"{k} {ratios[k]:.3g}" for k in failed)
