"""The backward pass from Python on a CUDA Hopper GPU (marker gpu; skipped with the reason elsewhere), EP = 1 on
GPU 0: mok.backward and autograd against a float64 PyTorch reference (autograd through reference_layer),
bitwise determinism and independence of the knobs, main_grads accumulation, recompute_forward_context,
mok.MoE (router inside, Megatron's main_grad, a context shared with recompute=True), torch.compile(fullgraph=True)
of forward and backward, a whole training step in a CUDA graph, bad inputs through the backward.

Tolerance against the reference: relative Frobenius error < TOLERANCE (2e-2) per gradient, the forward's budget:
the inputs are bf16 (upcast exactly), the GPU rounds g, u, h, d_g, d_u, dy, each route's d_x partial and the
outputs to bf16 (2^-9 relative each) and accumulates in fp32; tools/backward_rounding_sim.py's emulation of those
roundings gives 2.3e-3 to 3.5e-3 on these shapes (6x below the tolerance). Everything else is bit for bit.
"""
import dataclasses

import pytest
import torch

import mok
from conftest import make_inputs, make_weights
from test_gpu import SHAPES, TOLERANCE, relative_error, workspace

pytestmark = pytest.mark.gpu

WEIGHT_NAMES = ("expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up", "shared_down")


def make_d_out(shape, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed + 2000)
    return torch.randn(shape.num_tokens, shape.hidden, generator=gen).to(torch.bfloat16).cuda()


def poison_free_memory(megabytes=64):
    """Leaves NaN in the caching allocator's free blocks, so an output the backward forgets to write is NaN."""
    torch.full((megabytes << 18,), float("nan"), dtype=torch.float32, device="cuda")


def reference_layer(shape, x, idx, rw, w):
    """test_gpu.reference (the layer in float64), with the clamped SwiGLU's gradient masks taken where the GPU's
    backward takes them, on g and u rounded to bf16 (docs/design.md, "Backward", numerics note): with random data
    about 4e-4 of the elements lie within one bf16 rounding of the limit, and masking them on the exact values
    moves the gradients by 4 % (relative Frobenius). The values are the forward's (fp32-like: exact g, u)."""
    f64 = torch.float64
    x, rw = x.to(f64), rw.to(f64)
    i, limit = shape.intermediate, shape.swiglu_limit

    def mlp(rows, gate, up, down):
        g, u = rows @ gate.to(f64).T, rows @ up.to(f64).T
        if limit > 0:
            g_bf16, u_bf16 = g.detach().to(torch.bfloat16).to(f64), u.detach().to(torch.bfloat16).to(f64)
            g = torch.where(g_bf16 < limit, g, torch.full_like(g, limit))
            u = torch.where((-limit < u_bf16) & (u_bf16 < limit), u, u.detach().clamp(-limit, limit))
        return (torch.nn.functional.silu(g) * u) @ down.to(f64).T

    gate_all = w.expert_gate if w.expert_up is not None else w.expert_gate[:, :i]
    up_all = w.expert_up if w.expert_up is not None else w.expert_gate[:, i:]
    out = torch.zeros_like(x)
    if shape.shared_expert:
        out = out + mlp(x, w.shared_gate, w.shared_up, w.shared_down)
    for e in range(shape.num_experts):
        tokens, slots = (idx == e).nonzero(as_tuple=True)
        if tokens.numel():
            out = out.index_add(0, tokens, rw[tokens, slots, None] * mlp(x[tokens], gate_all[e], up_all[e],
                                                                         w.expert_down[e]))
    return out


def reference_grads(shape, x, idx, rw, w, d_out):
    """{name: float64 gradient} of the reference layer for d_out: d_x, d_router_weights and each present weight."""
    def leaf(t):
        return None if t is None else t.detach().double().requires_grad_(True)

    x64, rw64 = leaf(x), leaf(rw)
    w64 = mok.Weights(*[leaf(t) for t in w.tensors()])
    reference_layer(shape, x64, idx, rw64, w64).backward(d_out.double())
    grads = {"d_x": x64.grad, "d_router_weights": rw64.grad}
    for name in WEIGHT_NAMES:
        t = getattr(w64, name)
        if t is not None:
            grads[name] = t.grad if t.grad is not None else torch.zeros_like(t)
    return grads


def as_dict(d_x, d_rw, grads):
    out = {"d_x": d_x, "d_router_weights": d_rw}
    out.update({n: getattr(grads, n) for n in WEIGHT_NAMES if getattr(grads, n) is not None})
    return out


def check_against_reference(got, want, what):
    assert set(got) == set(want), f"{what}: gradients {sorted(got)} vs reference {sorted(want)}"
    for name, ref in want.items():
        g = got[name]
        assert g.shape == ref.shape, f"{what}: {name} shape {list(g.shape)} vs {list(ref.shape)}"
        assert torch.isfinite(g).all(), f"{what}: {name} has non-finite values at {(~torch.isfinite(g)).nonzero()[:1].tolist()}"
        error = relative_error(g, ref)
        assert error < TOLERANCE, f"{what}: {name} relative Frobenius error {error:.3e} >= {TOLERANCE}"


def assert_same_bits(got: dict, want: dict, what: str):
    assert set(got) == set(want), f"{what}: {sorted(got)} vs {sorted(want)}"
    for name, ref in want.items():
        g = got[name]
        assert g.dtype == ref.dtype and g.shape == ref.shape, f"{what}: {name} {g.dtype} {list(g.shape)} vs " \
                                                              f"{ref.dtype} {list(ref.shape)}"
        assert torch.equal(g, ref), f"{what}: {name} differs at {(g != ref).nonzero()[:1].tolist()}"


def layer_case(shape, seed, fused_gate_up=False, index_dtype=torch.int32):
    x, idx, rw = make_inputs(shape, "cuda", seed=seed, index_dtype=index_dtype)
    w = make_weights(shape, "cuda", seed=seed + 1, fused_gate_up=fused_gate_up)
    return x, idx, rw, w, make_d_out(shape, seed)


def functional_grads(ws, x, idx, rw, w, d_out, **kw):
    _, ctx = mok.forward(ws, x, idx, rw, w)
    poison_free_memory()
    grads = as_dict(*mok.backward(ws, d_out, x, idx, rw, w, ctx, **kw))
    mok.check_status(ws)
    return grads


def autograd_grads(ws, x, idx, rw, w, d_out):
    """The same gradients through autograd: leaves copied from the inputs, loss = sum(out * d_out)."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, rw, *w.tensors())]
    lx, lrw, lw = leaves[0], leaves[1], mok.Weights(*leaves[2:])
    out, _ = mok.forward(ws, lx, idx, lrw, lw)
    (out.float() * d_out.float()).sum().backward()
    mok.check_status(ws)
    grads = {"d_x": lx.grad, "d_router_weights": lrw.grad}
    grads.update({n: getattr(lw, n).grad for n in WEIGHT_NAMES if getattr(lw, n) is not None})
    return grads


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("path", ["fused", "unfused"])
def test_backward_matches_the_float64_reference(name, path):
    shape = SHAPES[name]
    ws = workspace(shape, path=path)
    x, idx, rw, w, d_out = layer_case(shape, seed=31)
    got = functional_grads(ws, x, idx, rw, w, d_out)
    check_against_reference(got, reference_grads(shape, x, idx, rw, w, d_out), f"{name} {path} (seed 31)")
    assert_same_bits(autograd_grads(ws, x, idx, rw, w, d_out), got, f"{name} {path}: autograd vs mok.backward")


def test_masked_routes_get_zero_router_gradient():
    shape = SHAPES["shared"]
    ws = workspace(shape)
    x, idx, rw, w, d_out = layer_case(shape, seed=33, index_dtype=torch.int64)
    idx[::3, 1] = -1
    got = functional_grads(ws, x, idx, rw, w, d_out)
    assert (got["d_router_weights"][::3, 1] == 0).all(), "a masked route's d_router_weights is not 0"
    check_against_reference(got, reference_grads(shape, x, idx, rw, w, d_out), "masked routes (seed 33)")


def test_fp32_gradients_round_to_the_bf16_ones_and_fill_the_callers_buffers():
    shape = SHAPES["shared"]
    ws = workspace(shape)
    x, idx, rw, w, d_out = layer_case(shape, seed=35)
    bf16 = functional_grads(ws, x, idx, rw, w, d_out)
    fp32 = functional_grads(ws, x, idx, rw, w, d_out, grad_dtype=torch.float32)
    check_against_reference(fp32, reference_grads(shape, x, idx, rw, w, d_out), "fp32 gradients (seed 35)")
    for name in WEIGHT_NAMES:
        assert fp32[name].dtype == torch.float32
        assert torch.equal(fp32[name].to(torch.bfloat16), bf16[name]), f"{name}: bf16 != fp32 rounded once"
    # Into NaN-poisoned buffers, all six and then two of them (bf16 and fp32 mixed).
    _, ctx = mok.forward(ws, x, idx, rw, w)
    buffers = {n: torch.full_like(getattr(w, n), float("nan")) for n in WEIGHT_NAMES}
    d_x, d_rw, grads = mok.backward(ws, d_out, x, idx, rw, w, ctx, grads=buffers)
    assert all(getattr(grads, n) is buffers[n] for n in WEIGHT_NAMES)
    assert_same_bits(as_dict(d_x, d_rw, grads), bf16, "grads= buffers")
    some = {"expert_down": torch.full_like(w.expert_down, float("nan")),  # bf16; the shared gate/up pair fp32
            "shared_gate": torch.full_like(w.shared_gate, float("nan"), dtype=torch.float32),
            "shared_up": torch.full_like(w.shared_up, float("nan"), dtype=torch.float32)}
    mok.backward(ws, d_out, x, idx, rw, w, ctx, grads=some)
    mok.check_status(ws)
    for name, buffer in some.items():
        want = bf16[name] if buffer.dtype == torch.bfloat16 else fp32[name]
        assert torch.equal(buffer, want), f"grads={{{name!r}: ...}} differs from the full backward's"


def test_fused_gate_up_gradients_equal_the_separate_ones():
    shape = SHAPES["no-shared"]
    ws = workspace(shape)
    x, idx, rw, w, d_out = layer_case(shape, seed=37)
    separate = functional_grads(ws, x, idx, rw, w, d_out)
    fused_w = make_weights(shape, "cuda", seed=38, fused_gate_up=True)
    assert torch.equal(fused_w.expert_gate, torch.cat([w.expert_gate, w.expert_up], dim=1))
    fused = functional_grads(ws, x, idx, rw, fused_w, d_out)
    assert set(fused) == {"d_x", "d_router_weights", "expert_gate", "expert_down"}
    separate["expert_gate"] = torch.cat([separate.pop("expert_gate"), separate.pop("expert_up")], dim=1)
    assert_same_bits(fused, separate, "fused gate/up vs separate")


def test_main_grads_accumulate_over_two_micro_batches():
    """main_grads += each micro-batch's gradient: after two, bitwise the fp32 sum of the two written gradients
    (weight_grad_gemm adds once per element: main_grad + g); d_x and d_router_weights as without main_grads."""
    shape = SHAPES["shared"]
    ws = workspace(shape)
    w = make_weights(shape, "cuda", seed=40)
    main = mok.main_grads(w)
    written = []
    for seed in (41, 43):
        x, idx, rw = make_inputs(shape, "cuda", seed=seed)
        d_out = make_d_out(shape, seed)
        written.append(functional_grads(ws, x, idx, rw, w, d_out, grad_dtype=torch.float32))
        _, ctx = mok.forward(ws, x, idx, rw, w)
        d_x, d_rw, returned = mok.backward(ws, d_out, x, idx, rw, w, ctx, main_grads=main)
        mok.check_status(ws)
        assert returned is main
        assert torch.equal(d_x, written[-1]["d_x"]) and torch.equal(d_rw, written[-1]["d_router_weights"])
        if seed == 41:
            for n in WEIGHT_NAMES:
                assert torch.equal(getattr(main, n), written[0][n]), f"{n}: 0 + g differs from g"
    for n in WEIGHT_NAMES:
        total = written[0][n] + written[1][n]
        got = getattr(main, n)
        assert torch.equal(got, total), f"{n}: main_grad differs from g1 + g2 at {(got != total).nonzero()[:1].tolist()}"


def test_backward_is_deterministic_and_independent_of_the_knobs():
    shape = SHAPES["shared"]
    x, idx, rw, w, d_out = layer_case(shape, seed=45)
    ws = workspace(shape)
    base = functional_grads(ws, x, idx, rw, w, d_out)
    assert_same_bits(functional_grads(ws, x, idx, rw, w, d_out), base, "rerun")
    for config in (dict(path="unfused"), dict(comm_ctas=2), dict(minibatch_rows=128),
                   dict(macrobatch_rows=256, minibatch_rows=128), dict(macrobatch_rows=128, minibatch_rows=128),
                   dict(tile_m=128), dict(backward_megakernel=True),
                   dict(backward_megakernel=True, macrobatch_rows=128, minibatch_rows=128, comm_ctas=2)):
        assert_same_bits(functional_grads(workspace(shape, **config), x, idx, rw, w, d_out), base, str(config))


def test_recompute_forward_context_gives_the_same_gradients():
    shape = SHAPES["clamped"]
    ws = workspace(shape)
    x, idx, rw, w, d_out = layer_case(shape, seed=47)
    base = functional_grads(ws, x, idx, rw, w, d_out)
    other_x, other_idx, other_rw = make_inputs(shape, "cuda", seed=49)
    _, ctx = mok.forward(ws, x, idx, rw, w)
    mok.recompute_forward_context(ws, x, w, ctx)  # on the schedule the forward left
    assert_same_bits(as_dict(*mok.backward(ws, d_out, x, idx, rw, w, ctx)), base, "recompute on the same schedule")
    mok.forward(ws, other_x, other_idx, other_rw, w, ctx)  # overwrites the context
    mok.build_schedule(ws, idx, ctx)
    mok.recompute_forward_context(ws, x, w, ctx)
    got = as_dict(*mok.backward(ws, d_out, x, idx, rw, w, ctx))
    mok.check_status(ws)
    assert_same_bits(got, base, "build_schedule + recompute after another forward")


def seeded_module(shape, seed, **kw):
    torch.manual_seed(seed)
    return mok.MoE(shape.hidden, shape.intermediate, shape.num_experts, shape.top_k,
                   shared_expert=shape.shared_expert, swiglu_limit=shape.swiglu_limit, **kw)


def module_grads(moe, x, d_out):
    """Output and gradients of loss = sum(moe(x) * d_out); moe may be torch.compile's wrapper of a mok.MoE."""
    layer = getattr(moe, "_orig_mod", moe)
    x = x.detach().clone().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    out = moe(x)
    (out.float() * d_out.float()).sum().backward()
    mok.check_status(layer.workspace)
    grads = {"x": x.grad, "out": out.detach()}
    grads.update({n: p.grad for n, p in layer.named_parameters()})
    return grads


def test_module_with_its_router_matches_the_float64_reference():
    shape = SHAPES["shared"]
    moe = seeded_module(shape, 51)
    x, _, _ = make_inputs(shape, "cuda", seed=52)
    d_out = make_d_out(shape, 52)
    got = module_grads(moe, x, d_out)
    # The reference routes like the module (its top-k ids), with router weights from float64 logits.
    idx, rw = moe.route(x)
    f64 = {n: p.detach().double().requires_grad_(True) for n, p in moe.named_parameters()}
    x64 = x.double().requires_grad_(True)
    probs = torch.softmax(x64 @ f64["router.weight"].T, dim=-1)
    out = reference_layer(shape, x64, idx, probs.gather(1, idx), mok.Weights(*[f64.get(n) for n in WEIGHT_NAMES]))
    out.backward(d_out.double())
    assert relative_error(got["out"], out.detach()) < TOLERANCE
    want = {"x": x64.grad, **{n: t.grad for n, t in f64.items()}}
    check_against_reference({n: got[n] for n in want}, want, "mok.MoE with its router (seeds 51/52)")
    # The experts' gradients are mok.backward's on the router's routing.
    _, ctx = mok.forward(moe.workspace, x, idx, rw.detach(), moe.weights())
    _, _, grads = mok.backward(moe.workspace, d_out, x, idx, rw.detach(), moe.weights(), ctx)
    for n in WEIGHT_NAMES:
        assert torch.equal(got[n], getattr(grads, n)), f"{n}: the module's gradient differs from mok.backward's"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_forward_and_backward(backend):
    shape = SHAPES["shared"]
    ws = workspace(shape)
    ctx = ws.make_context()
    x, idx, rw, w, d_out = layer_case(shape, seed=55)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, rw, *w.tensors())]

    def loss(x, rw):
        out, _ = mok.forward(ws, x, idx, rw, mok.Weights(*leaves[2:]), ctx)
        return (out.float() * d_out.float()).sum()

    def grads_of(fn):
        for t in leaves:
            t.grad = None
        fn(leaves[0], leaves[1]).backward()
        mok.check_status(ws)
        return {f"{i}": t.grad.clone() for i, t in enumerate(leaves)}

    eager = grads_of(loss)
    torch._dynamo.reset()
    compiled = grads_of(torch.compile(loss, fullgraph=True, backend=backend))
    assert_same_bits(compiled, eager, f"torch.compile({backend}) vs eager (0: x, 1: router weights, 2-7: weights)")


def test_compiled_module_equals_eager():
    shape = SHAPES["shared"]
    moe = seeded_module(shape, 57, num_tokens=shape.num_tokens)
    x, _, _ = make_inputs(shape, "cuda", seed=58)
    d_out = make_d_out(shape, 58)
    eager = module_grads(moe, x, d_out)
    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    got = module_grads(compiled, x, d_out)
    assert_same_bits({n: got[n] for n in eager}, eager, "mok.MoE compiled (aot_eager) vs eager")
    torch._dynamo.reset()
    inductor = module_grads(torch.compile(moe, fullgraph=True), x, d_out)  # the router's kernels are Inductor's
    for n, g in eager.items():
        assert relative_error(inductor[n], g.double()) < TOLERANCE, f"{n}: inductor vs eager"


def test_cuda_graph_replay_of_a_training_step_equals_eager():
    """Forward, backward and an SGD step of mok.MoE (router inside) captured in one CUDA graph, replayed on new
    data: losses and parameters bitwise equal to the same steps run eagerly on a twin module."""
    shape = SHAPES["shared"]
    eager, graphed = (seeded_module(shape, 61, num_tokens=shape.num_tokens) for _ in range(2))
    for (n, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters()):
        assert torch.equal(a, b), f"{n}: the twins start apart"
    opts = {m: torch.optim.SGD(m.parameters(), lr=1e-3) for m in (eager, graphed)}
    data = []
    for seed in range(62, 68):
        x, _, _ = make_inputs(shape, "cuda", seed=seed)
        data.append((x, make_d_out(shape, seed)))

    def step(moe, x, g):
        loss = (moe(x).float() * g.float()).sum()
        loss.backward()
        opts[moe].step()
        return loss

    eager_losses = []
    for x, g in data:
        opts[eager].zero_grad(set_to_none=True)
        eager_losses.append(step(eager, x, g).detach())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: steps 0 and 1, eagerly
        for x, g in data[:2]:
            opts[graphed].zero_grad(set_to_none=True)
            step(graphed, x, g)
    torch.cuda.current_stream().wait_stream(side)
    static_x, static_g = data[0][0].clone(), data[0][1].clone()
    opts[graphed].zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(graphed, static_x, static_g)
    for i, (x, g) in enumerate(data[2:], start=2):
        static_x.copy_(x)
        static_g.copy_(g)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_loss, eager_losses[i]), f"step {i}: loss {static_loss.item()} (replay) vs " \
                                                          f"{eager_losses[i].item()} (eager)"
    mok.check_status(graphed.workspace)
    mok.check_status(eager.workspace)
    for (n, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters()):
        assert torch.equal(a, b), f"{n}: after 6 steps, replayed != eager at {(a != b).nonzero()[:1].tolist()}"


def test_megatron_main_grad_convention():
    """main_grad=True: main_grad += each micro-batch's gradient (bitwise mok.backward(main_grads=...)); with
    Megatron's attribute the parameter gets grad_added_to_main_grad = True and a dummy gradient (zeros with
    zero_out_wgrad), without it no gradient; the router's gradient is autograd's."""
    shape = SHAPES["shared"]
    moe = seeded_module(shape, 71, main_grad=True, num_tokens=shape.num_tokens)
    moe.allocate_main_grads()
    params = {n: getattr(moe, n) for n in WEIGHT_NAMES}
    for n, p in params.items():
        if n != "expert_up":  # expert_up: a parameter Megatron's DDP does not know
            p.grad_added_to_main_grad = False
    params["shared_down"].zero_out_wgrad = True
    expected = mok.main_grads(moe.weights())
    ctx = moe.workspace.make_context()
    for seed in (72, 74):
        x, _, _ = make_inputs(shape, "cuda", seed=seed)
        d_out = make_d_out(shape, seed)
        (moe(x).float() * d_out.float()).sum().backward()
        for n, p in params.items():
            if n == "expert_up":
                assert p.grad is None and not hasattr(p, "grad_added_to_main_grad")
            else:
                assert p.grad_added_to_main_grad is True, n
                assert p.grad is not None and p.grad.shape == p.shape, n
                p.grad_added_to_main_grad, p.grad = False, None  # what Megatron's hook and zero_grad do
        assert moe.router.weight.grad is not None
        idx, rw = moe.route(x)
        mok.forward(moe.workspace, x, idx, rw.detach(), moe.weights(), ctx)
        mok.backward(moe.workspace, d_out, x, idx, rw.detach(), moe.weights(), ctx, main_grads=expected)
    mok.check_status(moe.workspace)
    for n, p in params.items():
        assert torch.equal(p.main_grad, getattr(expected, n)), f"{n}: main_grad differs from mok.backward's"
    (moe(x).float() * d_out.float()).sum().backward()
    assert (params["shared_down"].grad == 0).all(), "zero_out_wgrad: the dummy gradient must be zeros"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch.compile"])
def test_layers_sharing_one_context_with_recompute(compiled):
    """Two stacked layers on one workspace and one context (recompute=True) give bitwise the outputs and
    gradients of the same layers with a context each; no false error from the declared writes of the context
    (the second layer's backward rebuilds the context the first one's reads), eager and compiled per layer."""
    shape = SHAPES["shared"]
    ws = workspace(shape)
    shared_ctx = ws.make_context()
    sharing = [seeded_module(shape, 81 + i, workspace=ws, recompute=True, context=shared_ctx) for i in range(2)]
    separate = [seeded_module(shape, 81 + i, workspace=ws) for i in range(2)]
    x, _, _ = make_inputs(shape, "cuda", seed=83)
    d_out = make_d_out(shape, 83)

    def run(modules, layers):
        leaf = x.detach().clone().requires_grad_(True)
        out = layers[1](layers[0](leaf))
        (out.float() * d_out.float()).sum().backward()
        mok.check_status(ws)
        got = {"out": out.detach(), "x": leaf.grad}
        for i, module in enumerate(modules):
            got.update({f"{i}.{n}": p.grad for n, p in module.named_parameters()})
        return got

    torch._dynamo.reset()
    layers = [torch.compile(m, fullgraph=True, backend="aot_eager") for m in sharing] if compiled else sharing
    assert_same_bits(run(sharing, layers), run(separate, separate), "shared context + recompute vs a context each")
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch.compile"])
@pytest.mark.parametrize("order", ["together", "first-first", "last-first"])
def test_micro_batches_forwards_then_backwards_add_into_one_main_grad(compiled, order):
    """Two micro-batches' forwards, then both backwards (1F1B-like: one backward call, or either order), through
    one layer with recompute=True and main_grad=True: every backward adds into the same main_grad (declared
    written by mok::backward_into) and autograd raises no in-place-modification error; main_grad ends bitwise
    as after the two micro-batches run forward + backward one after another, eagerly (g1 + g2)."""
    shape = SHAPES["shared"]
    moe = seeded_module(shape, 76, main_grad=True, recompute=True, num_tokens=shape.num_tokens)
    moe.allocate_main_grads()
    batches = [make_inputs(shape, "cuda", seed=s)[0] for s in (77, 78)]
    d_outs = [make_d_out(shape, s) for s in (77, 78)]

    def main_grads():
        return {n: getattr(moe, n).main_grad.clone() for n in WEIGHT_NAMES}

    for x, d in zip(batches, d_outs):  # one after another (gradient accumulation)
        (moe(x).float() * d.float()).sum().backward()
    mok.check_status(moe.workspace)
    want = main_grads()
    for n in WEIGHT_NAMES:
        getattr(moe, n).main_grad.zero_()
    torch._dynamo.reset()
    layer = torch.compile(moe, fullgraph=True, backend="aot_eager") if compiled else moe
    losses = [(layer(x).float() * d.float()).sum() for x, d in zip(batches, d_outs)]
    if order == "together":
        (losses[0] + losses[1]).backward()
    else:
        for i in ((0, 1) if order == "first-first" else (1, 0)):
            losses[i].backward()
    mok.check_status(moe.workspace)
    assert_same_bits(main_grads(), want, f"main_grad after F F B B ({order}) vs F B F B")
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch.compile"])
def test_a_context_overwritten_before_its_backward_raises_and_the_next_step_is_correct(compiled):
    """The check runs inside mok::backward when it runs (the forward's `seen` against the context's generation),
    so it holds under torch.compile too."""
    shape = SHAPES["shared"]
    moe = seeded_module(shape, 85, num_tokens=shape.num_tokens)
    x1, _, _ = make_inputs(shape, "cuda", seed=86)
    x2, _, _ = make_inputs(shape, "cuda", seed=87)
    d_out = make_d_out(shape, 86)
    want = module_grads(moe, x1, d_out)
    torch._dynamo.reset()
    layer = torch.compile(moe, fullgraph=True, backend="aot_eager") if compiled else moe
    y1, y2 = layer(x1), layer(x2)  # the second forward overwrites the context the first one's backward needs
    with pytest.raises(RuntimeError, match="overwritten by a later forward"):
        ((y1.float() + y2.float()) * d_out.float()).sum().backward()
    assert_same_bits(module_grads(layer, x1, d_out), want, "the step after the refused backward")
    torch._dynamo.reset()


@pytest.mark.parametrize("main_grad", [False, True], ids=["grads", "main_grad"])
def test_blocks_compiled_one_by_one_equal_eager_bitwise(main_grad):
    """8 blocks of one shape sharing a workspace, each with its own context, routing given, compiled block by
    block (torch.compile per block, as torchtitan does): one compiled frame serves all 8, no graph break, and
    the input's and every parameter's gradients (or main_grad, added by mok::backward_into) equal eager's
    bitwise."""
    import torch._dynamo.testing
    shape = SHAPES["shared"]
    ws = workspace(shape)
    torch.manual_seed(91)
    blocks = [mok.MoE(shape.hidden, shape.intermediate, shape.num_experts, shape.top_k, router=False, workspace=ws,
                      context=ws.make_context(), main_grad=main_grad) for _ in range(8)]
    x, idx, rw = make_inputs(shape, "cuda", seed=92)
    d_out = make_d_out(shape, 92)

    def run(layers):
        h0 = x.detach().clone().requires_grad_(True)
        for b in blocks:
            for p in b.parameters():
                p.grad = None
            if main_grad:
                for p in b.weights().tensors():
                    p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        h = h0
        for layer in layers:
            h = layer(h, idx, rw)
        (h.float() * d_out.float()).sum().backward()
        mok.check_status(ws)
        grads = {"x": h0.grad, "out": h.detach()}
        if main_grad:  # no Megatron attributes: main_grad only, no .grad
            grads.update({f"{n}.{name}.main_grad": getattr(b, name).main_grad for n, b in enumerate(blocks)
                          for name in WEIGHT_NAMES})
        else:
            grads.update({f"{n}.{name}": p.grad for n, b in enumerate(blocks) for name, p in b.named_parameters()})
        return grads

    eager = run(blocks)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = run([torch.compile(b, fullgraph=True, backend=counter) for b in blocks])
    assert counter.frame_count == 1, f"{counter.frame_count} frames compiled for 8 blocks of one shape"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert_same_bits(compiled, eager, "8 blocks compiled one by one vs eager")
    torch._dynamo.reset()


@pytest.mark.parametrize("megakernel", [False, True], ids=["stage-kernels", "backward-megakernel"])
def test_bad_inputs_through_backward_raise_and_the_next_call_is_correct(megakernel):
    shape = SHAPES["shared"]
    ws = workspace(shape, backward_megakernel=megakernel)
    x, idx, rw, w, d_out = layer_case(shape, seed=91)
    _, ctx = mok.forward(ws, x, idx, rw, w)
    good = as_dict(*mok.backward(ws, d_out, x, idx, rw, w, ctx))
    mok.check_status(ws)
    with pytest.raises(ValueError, match=r"d_out: expected a contiguous bf16 tensor on cuda:0 of shape \[T, H\] = "
                                         r"\[384, 256\], got .*\[100, 256\]"):
        mok.backward(ws, d_out[:100], x, idx, rw, w, ctx)
    with pytest.raises(ValueError, match=r"d_out: .* got a float32"):
        mok.backward(ws, d_out.float(), x, idx, rw, w, ctx)
    with pytest.raises(ValueError, match=r"main_grads.expert_gate: expected a contiguous float32"):
        mok.backward(ws, d_out, x, idx, rw, w, ctx, main_grads={"expert_gate": torch.zeros_like(w.expert_gate)})
    other = workspace(shape)
    _, other_ctx = mok.forward(other, x, idx, rw, w)
    with pytest.raises(ValueError, match="ctx: made by another workspace"):
        mok.backward(ws, d_out, x, idx, rw, w, other_ctx)
    with pytest.raises(RuntimeError, match="holds no forward"):
        mok.backward(ws, d_out, x, idx, rw, w, ws.make_context())
    # Past the Python checks, the C++ API's (std::invalid_argument -> ValueError naming the argument).
    stream = torch.cuda.current_stream().cuda_stream
    d_x, d_rw = torch.empty_like(x), torch.empty_like(rw)
    with pytest.raises(ValueError, match="d_out"):
        ws._native.backward(d_out[:100], x, idx, rw, list(w.tensors()), d_x, d_rw, [None] * 6, False, ctx._native,
                            stream)
    with pytest.raises(ValueError, match="context"):
        ws._native.backward(d_out, x, idx, rw, list(w.tensors()), d_x, d_rw, [None] * 6, False, other_ctx._native,
                            stream)
    with pytest.raises(ValueError, match="expert_down"):
        ws._native.backward(d_out, x, idx, rw, list(w.tensors()), d_x, d_rw,
                            [None, None, torch.empty_like(w.expert_gate)] + [None] * 3, False, ctx._native, stream)
    inference = workspace(shape, backward=False)
    _, inference_ctx = mok.forward(inference, x, idx, rw, w)
    with pytest.raises(ValueError, match=r"Config\(backward=False\)"):
        mok.backward(inference, d_out, x, idx, rw, w, inference_ctx)
    with pytest.raises((RuntimeError, ValueError), match="(?i)backward"):  # the C++ API's own refusal
        inference._native.backward(d_out, x, idx, rw, list(w.tensors()), d_x, d_rw, [None] * 6, False,
                                   inference_ctx._native, stream)
    again = as_dict(*mok.backward(ws, d_out, x, idx, rw, w, ctx))
    mok.check_status(ws)
    assert_same_bits(again, good, "the backward after the refused calls")


@pytest.mark.parametrize("megakernel", [False, True], ids=["stage-kernels", "backward-megakernel"])
def test_nan_in_d_out_stays_in_its_token(megakernel):
    """A NaN in one token's d_out reaches that token's d_x and d_router_weights and the weight gradients it
    contributes to (the shared expert's, its experts'), nothing else; the next clean call is bitwise clean.
    Both backward paths."""
    shape = SHAPES["shared"]
    ws = workspace(shape, backward_megakernel=megakernel)
    x, idx, rw, w, d_out = layer_case(shape, seed=93)
    clean = functional_grads(ws, x, idx, rw, w, d_out)
    dirty_d_out = d_out.clone()
    dirty_d_out[9, 5] = float("nan")
    dirty = functional_grads(ws, x, idx, rw, w, dirty_d_out)
    others = torch.ones(shape.num_tokens, dtype=torch.bool, device="cuda")
    others[9] = False
    for name in ("d_x", "d_router_weights"):
        assert not torch.isfinite(dirty[name][9]).all(), f"{name}[9] should be non-finite"
        assert torch.equal(dirty[name][others], clean[name][others]), f"{name}: the NaN reached other tokens"
    for e in range(shape.num_experts):
        routed = bool((idx[9] == e).any())
        for name in ("expert_gate", "expert_up", "expert_down"):
            if not routed:
                assert torch.equal(dirty[name][e], clean[name][e]), f"{name}[{e}]: token 9 does not route there"
    assert_same_bits(functional_grads(ws, x, idx, rw, w, d_out), clean, "the clean call after the NaN")
